"""The per-step context store: each distinct saved tensor is compressed once, and saved-byte accounting.

A LayerNorm output read by the Q, K and V projections (and kept by the LayerNorm itself) is quantized once:
:meth:`ContextStore.compress` returns the same :class:`PackedTensor` (the same payload tensors) to every op
that asks for the same tensor at the same bits, and each op saves those tensors with
``ctx.save_for_backward``; autograd then holds one copy.

Identity is exact: the key is the storage pointer, storage offset, shape, stride and dtype, and an entry is
valid only while the tensor it was made from is alive (so the storage cannot have been reused) and its
version counter is unchanged (so it was not modified in place). Entries hold weak references only: they live
exactly as long as some autograd graph keeps the packed tensors, and no step boundary is needed.

Slots name what is stored by module path and role (``bert.encoder.layer.3.attention.self.query:input``),
never by save order. Each slot carries its own bits (``ContextStore.bits``), which the adaptive allocator
sets.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from .compress import PackedSpec, PackedTensor, quantize

__all__ = ["ContextStore", "SavedTracker", "store", "track_saved"]

_PURGE_EVERY = 512


@dataclass
class _Entry:
    source: weakref.ref
    version: int
    tensors: tuple[weakref.ref, weakref.ref, weakref.ref]
    spec: PackedSpec

    def get(self, x: torch.Tensor) -> PackedTensor | None:
        if self.source() is None or x._version != self.version:
            return None
        tensors = tuple(r() for r in self.tensors)
        if any(t is None for t in tensors):
            return None
        return PackedTensor.rebuild(tensors, self.spec)

    def alive(self) -> bool:
        return self.source() is not None and all(r() is not None for r in self.tensors)


class ContextStore:
    """Compresses each distinct tensor once per (bits, group size) and remembers per-slot bits.

    Thread-local entries (each thread runs its own forward); the per-slot bits are shared.
    """

    def __init__(self) -> None:
        self._local = threading.local()
        self.bits: dict[str, int] = {}
        self._trackers: list[SavedTracker] = []

    @property
    def _entries(self) -> dict[tuple, _Entry]:
        entries = getattr(self._local, "entries", None)
        if entries is None:
            entries = self._local.entries = {}
            self._local.inserts = 0
        return entries

    def bits_for(self, slot: str, default: int) -> int:
        """Bits allocated to ``slot`` (by the adaptive allocator), else ``default``."""
        return self.bits.get(slot, default)

    def compress(self, x: torch.Tensor, *, slot: str, bits: int, group_size: int) -> PackedTensor:
        """Quantize ``x`` for the backward context, or return the packed copy made earlier for it."""
        key = (x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape), x.stride(), x.dtype, bits,
               group_size, x.device)
        entries = self._entries
        entry = entries.get(key)
        packed = entry.get(x) if entry is not None else None
        if packed is None:
            packed = quantize(x, bits, group_size)
            entries[key] = _Entry(weakref.ref(x), x._version, tuple(weakref.ref(t) for t in packed.tensors),
                                  packed.spec)
            self._local.inserts += 1
            if self._local.inserts % _PURGE_EVERY == 0:
                self._purge()
            self.register(packed.tensors, slot=slot, original_nbytes=packed.spec.numel * _itemsize(x.dtype))
        return packed

    def register(self, tensors: tuple[torch.Tensor, ...] | list[torch.Tensor], *, slot: str,
                 original_nbytes: int) -> None:
        """Label compressed tensors made outside :meth:`compress` (few-bit codes, 1-bit masks, pooling
        indices) with their slot and the size of what they stand for, for :func:`track_saved`."""
        for tracker in self._trackers:
            tracker._label(tensors, slot, original_nbytes)

    def _purge(self) -> None:
        entries = self._entries
        for key in [k for k, e in entries.items() if not e.alive()]:
            del entries[key]

    def clear(self) -> None:
        """Forget all entries of this thread (packed tensors already saved by autograd are unaffected)."""
        self._entries.clear()

    def __len__(self) -> int:
        self._purge()
        return len(self._entries)


store = ContextStore()


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _is_parameter_like(t: torch.Tensor, param_shapes: dict | None = None) -> bool:
    """A parameter, autocast's dtype cast of one, or a view (``w.t()``) of either: weights, not activations.

    A cast of a *frozen* weight has no autograd history; it is recognised only when the model's parameters
    are known (``param_shapes``: shape -> dtypes): a leaf without gradient whose shape, or transposed shape,
    is a parameter's while its dtype is not (per-channel statistics share a weight's shape *and* dtype).
    """
    while t._is_view() and t._base is not None:
        t = t._base
    if isinstance(t, nn.Parameter):
        return True
    fn = t.grad_fn
    if fn is not None and type(fn).__name__ == "ToCopyBackward0":
        nxt = fn.next_functions
        return len(nxt) == 1 and nxt[0][0] is not None and type(nxt[0][0]).__name__ == "AccumulateGrad"
    if fn is None and not t.requires_grad and param_shapes and t.dim() >= 1 and t.is_floating_point():
        dtypes = param_shapes.get(tuple(t.shape))
        return dtypes is not None and t.dtype not in dtypes
    return False


@dataclass
class SavedTracker:
    """Result of :func:`track_saved`.

    Attributes:
        bytes: bytes of the unique storages saved for backward (parameters excluded; packed payloads at their
            packed size, metadata included).
        by_slot: the same bytes split by slot; tensors saved uncompressed go under ``"<uncompressed>"`` with
            their dtype, e.g. ``"<uncompressed:torch.bfloat16>"``.
        num_tensors: how many unique storages were saved.
        uncompressed_bytes: what the same context would take uncompressed: compressed entries at the size of
            the tensors they stand for, everything else as saved. ``uncompressed_bytes / bytes`` is the
            compression ratio of the saved context (not counting the sharing act_hf adds).
    """

    bytes: int = 0
    by_slot: dict[str, int] = field(default_factory=dict)
    num_tensors: int = 0
    uncompressed_bytes: int = 0
    _seen: set = field(default_factory=set, repr=False)
    _labels: dict = field(default_factory=dict, repr=False)
    _exclude: set = field(default_factory=set, repr=False)
    _param_shapes: dict = field(default_factory=dict, repr=False)
    _keep: list = field(default_factory=list, repr=False)  # holds counted storages: no address reuse while tracking

    def _label(self, tensors, slot: str, original_nbytes: int) -> None:
        for i, t in enumerate(tensors):
            self._labels[t.untyped_storage().data_ptr()] = (slot, original_nbytes if i == 0 else 0)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if _is_parameter_like(t, self._param_shapes):
            return t
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._exclude or (ptr, t.device) in self._seen or storage.nbytes() == 0:
            return t
        self._seen.add((ptr, t.device))
        self._keep.append(t)
        nbytes = storage.nbytes()
        slot, original = self._labels.get(ptr, (f"<uncompressed:{t.dtype}>", nbytes))
        self.uncompressed_bytes += original
        self.bytes += nbytes
        self.num_tensors += 1
        self.by_slot[slot] = self.by_slot.get(slot, 0) + nbytes
        return t

    @property
    def megabytes(self) -> float:
        return self.bytes / 2**20

    @property
    def ratio(self) -> float:
        """``uncompressed_bytes / bytes`` (1.0 when nothing was saved)."""
        return self.uncompressed_bytes / self.bytes if self.bytes else 1.0


@contextlib.contextmanager
def track_saved(model: nn.Module | None = None) -> Iterator[SavedTracker]:
    """Measure the activation memory saved for backward inside the block.

    Counts the unique storages that autograd saves (through ``saved_tensors_hooks``), at their real size:
    act_hf's packed payloads are counted packed. Parameters, their autocast casts and views of either (the
    ``w.t()`` a linear saves) are excluded; with ``model`` given, so are all its parameters and buffers and the
    autocast casts of its frozen weights (recognised by shape). Works on CPU and GPU alike.

    Example:
        >>> with act_hf.track_saved(model) as saved:
        ...     loss = model(**batch).loss
        >>> saved.bytes, saved.by_slot
    """
    tracker = SavedTracker()
    if model is not None:
        for t in list(model.parameters()) + list(model.buffers()):
            tracker._exclude.add(t.untyped_storage().data_ptr())
            if t.dim() >= 1 and t.numel() > 1:
                for shape in (tuple(t.shape), tuple(reversed(t.shape))):
                    tracker._param_shapes.setdefault(shape, set()).add(t.dtype)
    store._trackers.append(tracker)
    try:
        with torch.autograd.graph.saved_tensors_hooks(tracker._pack, lambda t: t):
            yield tracker
    finally:
        store._trackers.remove(tracker)
        tracker._keep.clear()
