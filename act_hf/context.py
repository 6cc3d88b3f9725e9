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
never by save order. An adaptive model's allocator gives each slot its own bits in the model's slot-bits table
(:meth:`ContextStore.bits_for`).

During a sensitivity probe (:meth:`ContextStore.probing`, used by :mod:`act_hf.adapt`) every quantized tensor
also gets a second, independently drawn "twin", and the slots that quantize the same tensor are joined into
one group; :meth:`ContextStore.resolve` hands an op's backward the twin instead of the original for the group
being redrawn, so the gradient can be recomputed with one group's random draws changed and everything else
(forward, dropout masks, the other groups' draws) the same.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ._chunks import chunk_elements
from .compress import PackedSpec, PackedTensor, quantize, quantize_by_rows, quantize_normalized
from .regions import enter_own_hooks, leave_own_hooks
from .swap import HostSwap

__all__ = ["ContextStore", "Probe", "SavedTracker", "store", "track_saved"]

_PURGE_EVERY = 512


@dataclass
class _Entry:
    source: weakref.ref
    version: int
    tensors: tuple[weakref.ref, ...]
    spec: PackedSpec

    def get(self, x: torch.Tensor) -> PackedTensor | None:
        if self.source() is None or x._version != self.version:
            return None
        tensors = tuple(r() for r in self.tensors)
        if any(t is None for t in tensors):
            return None
        return PackedTensor.rebuild(tensors, self.spec)

    def form(self, x: torch.Tensor) -> PackedSpec | None:
        """The spec of the copy made for ``x`` while ``x`` is unchanged, even when the copy itself was freed."""
        return None if self.source() is None or x._version != self.version else self.spec

    def alive(self) -> bool:
        """Whether the entry can still be asked: while its source lives, its form is needed even after the copy
        was freed (see :meth:`ContextStore.compress`)."""
        return self.source() is not None


class Probe:
    """What a sensitivity probe records: slot groups, their sizes, and a twin draw of every quantized tensor.

    Attributes:
        redraw: the group whose twins :meth:`ContextStore.resolve` returns (``None``: the originals).
    """

    def __init__(self) -> None:
        self.redraw: str | None = None
        self._parent: dict[str, str] = {}
        self._tensors: dict[tuple, tuple[weakref.ref, str]] = {}  # identity (no bits) -> live source, first slot
        self._numel: dict[str, int] = {}  # first slot -> elements of the distinct tensors it quantized first
        self._twins: dict[int, tuple[str, PackedTensor]] = {}  # payload address -> first slot, twin
        self._uses: dict[str, int] = {}  # first slot -> compress calls that returned its tensors
        self._saves: dict[str, int] = {}  # first slot -> times an act_hf op saved them (save_context)
        self._consumers: dict[str, list] = {}  # first slot -> backward nodes of the ops that saved them

    def _find(self, slot: str) -> str:
        parent = self._parent.setdefault(slot, slot)
        if parent != slot:
            parent = self._parent[slot] = self._find(parent)
        return parent

    def _union(self, a: str, b: str) -> None:
        ra, rb = self._find(a), self._find(b)
        if ra != rb:
            self._parent[max(ra, rb)] = min(ra, rb)  # the smaller name represents the group: deterministic

    def _record(self, x: torch.Tensor, key: tuple, slot: str) -> None:
        self._find(slot)
        known = self._tensors.get(key)
        if known is not None and known[0]() is not None:  # the same storage, layout and dtype: the same values
            self._union(slot, known[1])
        else:
            self._tensors[key] = (weakref.ref(x), slot)
            self._numel[slot] = self._numel.get(slot, 0) + x.numel()

    def _used(self, packed: PackedTensor) -> None:
        hit = self._twins.get(packed.payload.data_ptr())
        if hit is not None:  # None: packed before the probe began, so it has no twin to swap in
            self._uses[hit[0]] = self._uses.get(hit[0], 0) + 1

    def saved_by(self, node: Any, items: tuple) -> None:
        """Note that the autograd ``node`` (an act_hf op's ``ctx``) saved the packed ``items``."""
        for item in items:
            hit = self._twins.get(item.payload.data_ptr()) if isinstance(item, PackedTensor) else None
            if hit is not None:
                self._saves[hit[0]] = self._saves.get(hit[0], 0) + 1
                self._consumers.setdefault(hit[0], []).append(node)

    def groups(self) -> dict[str, dict]:
        """``{group: {"slots", "numel", "consumers"}}``: a group is a set of slots linked by quantizing the same
        tensor (a LayerNorm output shared by Q, K and V) or by one slot quantizing several tensors (a module
        called more than once); ``numel`` counts the elements it quantized; ``consumers`` lists the backward
        nodes of the act_hf ops that saved its tensors, or is ``None`` when some use is not one of them (a
        saved-tensor hook of the generic fallback): then only a whole backward pass sees all of its effect."""
        out: dict[str, dict] = {}
        for slot in self._parent:
            out.setdefault(self._find(slot), {"slots": [], "numel": 0, "consumers": []})["slots"].append(slot)
        for slot, numel in self._numel.items():
            out[self._find(slot)]["numel"] += numel
        for first, uses in self._uses.items():
            group = out[self._find(first)]
            if group["consumers"] is not None and self._saves.get(first, 0) == uses:
                group["consumers"].extend(n for n in self._consumers.get(first, []) if n not in group["consumers"])
            else:
                group["consumers"] = None
        for group in out.values():
            group["slots"].sort()
        return out


class ContextStore:
    """Compresses each distinct tensor once per (bits, group size) and remembers per-slot bits.

    The entries are shared by all threads: a checkpoint's recomputation runs in the thread that runs backward
    (on CUDA, autograd's device thread), and must find the entries the forward made in its own.

    Attributes:
        force_bits: when set, every slot is quantized at this width (the allocator's near-exact reference).
        swap: the host-memory swap of contexts compressed with ``swap=True`` (see :mod:`act_hf.swap`).
        uncheckpointed: set while the adaptive allocator probes: its backward passes are
            ``torch.autograd.grad``, so :func:`act_hf.checkpoint.checkpoint` runs layers uncheckpointed.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple, _Entry] = {}
        self._inserts = 0
        self._lock = threading.Lock()  # inserts and purges; a lookup is one dict read
        self.force_bits: int | None = None
        self.uncheckpointed = False
        self.swap = HostSwap()
        self._trackers: list[SavedTracker] = []
        self._probe: Probe | None = None

    def bits_for(self, slot: str, default: int, slot_bits: Mapping[str, int] | None = None) -> int:
        """Bits of ``slot``: those in ``slot_bits`` (an adaptive model's table, ``model.act_hf_slot_bits``, which
        its allocator fills), else ``default`` (always, for ``None``: fixed bits); ``force_bits`` overrides both.

        The table belongs to the model (its converted modules and hooks hold it), so two models with the same
        module paths never read each other's allocation, ``copy.deepcopy`` gives a copy a table of its own,
        pickling keeps it, and it goes with the model."""
        if self.force_bits is not None:
            return self.force_bits
        return default if slot_bits is None else slot_bits.get(slot, default)

    def compress(self, x: torch.Tensor, *, slot: str, bits: int, group_size: int, swap: bool = False,
                 channel_scale: bool = False) -> PackedTensor:
        """Quantize ``x`` for the backward context (``channel_scale``: see :func:`act_hf.compress.quantize`), or
        return the packed copy made earlier for it at the same bits and group size. That copy is channel scaled
        if the op that packed it first asked for it (a LayerNorm's output, read next by linears that do not
        ask): either way it is an unbiased estimate of ``x``, and ``x`` is packed once.

        With ``swap`` and ``x`` on a CUDA device, the packed copy is moved to pinned host memory (the returned
        tensor is the host one; :meth:`resolve` brings it back in backward)."""
        swap = swap and x.is_cuda
        key = self._key(x, bits, group_size, swap)
        entries = self._entries
        entry = entries.get(key)
        packed = entry.get(x) if entry is not None else None
        if packed is not None and swap:
            self.swap.reused(packed)
        if packed is None:
            form = entry.form(x) if entry is not None else None
            if form is not None:
                # The copy was freed while x lives: a non-reentrant checkpoint's forward drops what ops save.
                # Pack again in the first packer's form, so the recomputation, where the copy is shared, saves
                # tensors of the same shapes (torch's checkpoint checks them).
                channel_scale = form.channel_scaled
            packed = quantize(x, bits, group_size, channel_scale=channel_scale)
            if swap:
                packed = self._offload(packed)
            made = _Entry(weakref.ref(x), x._version, tuple(weakref.ref(t) for t in packed.tensors), packed.spec)
            with self._lock:
                entries[key] = made
                self._inserts += 1
                purge = self._inserts % _PURGE_EVERY == 0
            if purge:
                self._purge()
            self.register(packed.tensors, slot=slot, original_nbytes=packed.spec.numel * x.dtype.itemsize)
            if self._probe is not None:
                self._probe._twins[packed.payload.data_ptr()] = (slot, quantize(x, bits, group_size,
                                                                                  channel_scale=channel_scale))
        if self._probe is not None:
            self._probe._record(x, key[:5] + key[7:8], slot)
            self._probe._used(packed)
        return packed

    @staticmethod
    def _key(x: torch.Tensor, bits: int, group_size: int, swap: bool) -> tuple:
        return (x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape), x.stride(), x.dtype, bits,
                group_size, x.device, swap)

    def follow_dirty_bump(self, x: torch.Tensor, settings: Any) -> None:
        """``x`` was packed (:meth:`compress_as` with ``settings``) inside the forward of an autograd Function that
        wrote into it and marked it dirty: autograd bumps ``x``'s version once as that forward returns, and the
        copy made at the version before is still ``x``'s, for the ops that read ``x`` next."""
        entry = self._entries.get(self._key(x, settings.bits, settings.group_size, settings.swap and x.is_cuda))
        if entry is not None and entry.source() is x and entry.version == x._version - 1:
            entry.version = x._version

    def compress_as(self, x: torch.Tensor, settings: Any) -> PackedTensor:
        """:meth:`compress` with an op's :class:`~act_hf.ops._saving.OpSettings`."""
        return self.compress(x, slot=settings.slot, bits=settings.bits, group_size=settings.group_size,
                             swap=settings.swap, channel_scale=settings.channel_scale)

    def compress_by_rows(self, make: Callable[[int, int], torch.Tensor], shape: torch.Size, settings: Any, *,
                         device: torch.device) -> PackedTensor:
        """:meth:`compress_as` of a tensor that only its op reads (an intermediate, never seen by another op), given
        as ``make(start, stop)``, its rows ``start:stop`` along dim 0, and packed slice by slice
        (:func:`act_hf.compress.quantize_by_rows`): the full-size tensor is never made. It is made whole and
        compressed as usual while a probe runs (it keeps a second draw of the tensor) and when ``settings`` ask
        for channel scaling (over the whole tensor)."""
        if self._probe is not None or settings.channel_scale:
            return self.compress_as(make(0, shape[0]), settings)
        return self._kept(quantize_by_rows(make, shape, settings.bits, settings.group_size,
                                           chunk=4 * chunk_elements(device)), settings)

    def compress_normalized(self, x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor, settings: Any,
                            make: Callable[[int, int], torch.Tensor]) -> PackedTensor:
        """BatchNorm's normalized input, ``(x - mean) * invstd`` per channel of dim 1, whose rows ``start:stop`` are
        ``make(start, stop)``: packed straight from ``x`` (:func:`act_hf.compress.quantize_normalized`, which never
        makes it, not even a slice) for a contiguous fp32 or bf16 ``x`` (the statistics widened to fp32: a bf16
        model's are bf16 on the CPU); otherwise, and while a probe runs or ``settings`` ask for channel scaling,
        :meth:`compress_by_rows` of ``make``."""
        if (self._probe is not None or settings.channel_scale or not x.is_contiguous() or x.dim() < 2
                or x.dtype not in (torch.float32, torch.bfloat16)):
            return self.compress_by_rows(make, x.shape, settings, device=x.device)
        return self._kept(quantize_normalized(x, mean.float(), invstd.float(), settings.bits, settings.group_size),
                          settings)

    def _kept(self, packed: PackedTensor, settings: Any) -> PackedTensor:
        """``packed``, an op's own intermediate, swapped to host memory if ``settings`` ask, and labelled with its
        slot for the trackers."""
        if settings.swap and packed.payload.is_cuda:
            packed = self._offload(packed)
        spec = packed.spec
        self.register(packed.tensors, slot=settings.slot, original_nbytes=spec.numel * spec.dtype.itemsize)
        return packed

    def _offload(self, packed: PackedTensor) -> PackedTensor:
        """``packed`` swapped to host memory, its host tensors counted as such by the trackers."""
        packed = self.swap.offload(packed)
        for tracker in self._trackers:
            tracker._host.update(t.untyped_storage().data_ptr() for t in packed.tensors)
        return packed

    @contextlib.contextmanager
    def probing(self) -> Iterator[Probe]:
        """Record slot groups and twin draws for the forwards run inside the block (see :class:`Probe`).

        The twins stay reachable through :meth:`resolve` until the block exits, so the backward passes of a
        probe run inside it too.
        """
        if self._probe is not None:
            raise RuntimeError("a sensitivity probe is already running")
        self._probe = probe = Probe()
        try:
            yield probe
        finally:
            self._probe = None

    def resolve(self, packed: PackedTensor) -> PackedTensor:
        """What a backward reads for the saved ``packed``: its twin draw when a probe is redrawing the group it
        belongs to, the device copy when it was swapped to host memory, else ``packed`` itself."""
        probe = self._probe
        if probe is not None and probe.redraw is not None:
            hit = probe._twins.get(packed.payload.data_ptr())
            if hit is not None and probe._find(hit[0]) == probe.redraw:
                return hit[1]
        if not packed.payload.is_cuda and self.swap.is_swapped(packed):
            return self.swap.fetch(packed)
        return packed

    def register(self, tensors: tuple[torch.Tensor, ...] | list[torch.Tensor], *, slot: str,
                 original_nbytes: int) -> None:
        """Label compressed tensors made outside :meth:`compress` (few-bit codes, 1-bit masks, pooling
        indices) with their slot and the size of what they stand for, for :func:`track_saved`."""
        for tracker in self._trackers:
            tracker._label(tensors, slot, original_nbytes)

    def _purge(self) -> None:
        """Drop the entries whose source died."""
        with self._lock:
            entries = self._entries
            for key in [k for k, e in entries.items() if not e.alive()]:
                del entries[key]

    def clear(self) -> None:
        """Forget all entries (packed tensors already saved by autograd are unaffected)."""
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        self._purge()
        return len(self._entries)


store = ContextStore()


def _without_history(t: torch.Tensor) -> torch.Tensor:
    """What a saved-tensor pack hook may keep of ``t``: ``t`` detached when it has a ``grad_fn``, else ``t``.

    Kept with its ``grad_fn``, an op's saved *output* would hold that op's node alive, a cycle through C++ that
    Python's gc cannot break when the forward is never run backward (autograd itself saves outputs without
    their ``grad_fn`` and re-attaches it on unpacking). Other tensors are kept as they are: the context store
    tells packed copies apart by the life of their tensor objects."""
    return t.detach() if t.grad_fn is not None else t


#: autograd nodes of ops that view their one input (a weight's ``w.T`` before autocast casts it)
_VIEW_NODES = frozenset({"TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0",
                         "UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1", "ExpandBackward0"})


def _is_parameter_like(t: torch.Tensor, param_shapes: dict | None = None) -> bool:
    """A parameter, autocast's dtype cast of one, or a view (``w.t()``) of either, or a cast of such a view
    (Falcon's ``x @ self.weight.T`` under autocast): weights, not activations.

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
        while True:
            nxt = fn.next_functions
            if len(nxt) != 1 or nxt[0][0] is None:
                return False
            fn = nxt[0][0]
            if type(fn).__name__ == "AccumulateGrad":
                return True
            if type(fn).__name__ not in _VIEW_NODES:
                return False
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
        host_bytes: packed contexts swapped to pinned host memory (``ActConfig(swap=True)``); they are in
            none of the other counts.
        largest: the largest single storage counted in ``bytes``: of an unpatched model, its largest saved
            activation (:mod:`act_hf.estimate` sizes act_hf's transient working set by it).
    """

    bytes: int = 0
    host_bytes: int = 0
    largest: int = 0
    by_slot: dict[str, int] = field(default_factory=dict)
    num_tensors: int = 0
    uncompressed_bytes: int = 0
    _seen: set = field(default_factory=set, repr=False)
    _labels: dict = field(default_factory=dict, repr=False)
    _exclude: set = field(default_factory=set, repr=False)
    _param_shapes: dict = field(default_factory=dict, repr=False)
    _keep: list = field(default_factory=list, repr=False)  # holds counted storages: no address reuse while tracking
    _host: set = field(default_factory=set, repr=False)  # addresses of swapped host copies

    def _label(self, tensors, slot: str, original_nbytes: int) -> None:
        for i, t in enumerate(tensors):
            self._labels[t.untyped_storage().data_ptr()] = (slot, original_nbytes if i == 0 else 0)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        """Count ``t``; return what the hook keeps: ``t`` itself, detached when it has a ``grad_fn``."""
        detached = _without_history(t)
        if _is_parameter_like(t, self._param_shapes):
            return detached
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._exclude or (ptr, t.device) in self._seen or storage.nbytes() == 0:
            return detached
        self._seen.add((ptr, t.device))
        self._keep.append(detached)
        nbytes = storage.nbytes()
        if ptr in self._host:
            self.host_bytes += nbytes
            return detached
        slot, original = self._labels.get(ptr, (f"<uncompressed:{t.dtype}>", nbytes))
        self.uncompressed_bytes += original
        self.bytes += nbytes
        self.largest = max(self.largest, nbytes)
        self.num_tensors += 1
        self.by_slot[slot] = self.by_slot.get(slot, 0) + nbytes
        return detached

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

    A forward tracked here and never run backward frees its graph as soon as its output is dropped (the hook
    keeps tensors without their history, see :func:`_without_history`).

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
    pack = tracker._pack
    enter_own_hooks(pack)  # measuring must not change what a forward shares (see act_hf.regions)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield tracker
    finally:
        leave_own_hooks()
        store._trackers.remove(tracker)
        tracker._keep.clear()
