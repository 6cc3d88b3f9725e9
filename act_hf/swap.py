"""Swapping packed backward context to pinned host memory, with prefetch (GACT's L2, ActNN's L4).

With ``ActConfig(swap=True)``, each :class:`PackedTensor` that :meth:`ContextStore.compress` makes on a CUDA
device is copied to pinned host memory on a side stream as soon as it is packed; autograd then saves the host
copy, and the device copy is freed once the transfer has run. In backward, the first op that needs a swapped
context brings it back; each fetch also starts copying back the ``prefetch`` contexts that were swapped out just
before it (backward runs roughly in reverse forward order), on the side stream, so the transfers overlap with
the backward kernels.

Contracts:

- Values are exact: a fetched context is bit-identical to the packed one, so gradients with and without swap
  are equal for the same random draws.
- Stream safety: the device-to-host copy waits for the kernels that produced the packed tensors, the device
  tensors are kept from reuse until it ran (``record_stream``), and the compute stream waits for a prefetch
  before using its result.
- A context shared by several ops (a LayerNorm output read by Q, K and V) is swapped once; its device copy is
  kept from its first fetch until each op that saved it has fetched it.
- Only CUDA tensors are swapped: on a CPU the context already lives in host memory and is left as it is.
- :func:`act_hf.track_saved` counts swapped bytes in ``host_bytes``, not in ``bytes`` (device memory).

Costs: the transfers move packed bytes only (about a tenth of the uncompressed activations at 3 bits), but a
step still waits for any fetch its prefetch did not cover; pinned memory comes from PyTorch's caching host
allocator.
"""

from __future__ import annotations

import bisect
import weakref
from dataclasses import dataclass

import torch

from .compress import PackedTensor

__all__ = ["HostSwap"]


@dataclass(eq=False)
class _Swapped:
    """One swapped context: its host tensors (weakly: autograd owns them), the transfer's completion event, and
    the device copy once fetched or prefetched."""

    host: tuple[weakref.ref, ...]
    spec: object
    device: torch.device
    order: int
    written: torch.cuda.Event | None
    uses: int = 1
    fetched: tuple[torch.Tensor, ...] | None = None
    ready: torch.cuda.Event | None = None
    consumed: int = 0

    def alive(self) -> bool:
        return all(r() is not None for r in self.host)


class HostSwap:
    """The swap-out/fetch bookkeeping shared by all ops (one per process, owned by the context store).

    Args:
        prefetch: how many earlier-swapped contexts each fetch starts copying back.
    """

    def __init__(self, prefetch: int = 2) -> None:
        self.prefetch = prefetch
        self._by_ptr: dict[int, _Swapped] = {}  # host payload address -> record (address unique while alive)
        self._order: list[_Swapped] = []  # swap-out order
        self._counter = 0
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    # -- forward ------------------------------------------------------------------------------------------
    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def offload(self, packed: PackedTensor) -> PackedTensor:
        """Start copying ``packed`` (on a CUDA device) to pinned host memory; returns the host-side packed tensor
        that autograd should save in its place."""
        device = packed.device
        side = self._stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in packed.tensors)
            for h, t in zip(host, packed.tensors):
                h.copy_(t, non_blocking=True)
                t.record_stream(side)  # the allocator must not hand t's memory out before the copy ran
            written = side.record_event()
        if self._counter % 256 == 0:
            self.purge()
        record = _Swapped(tuple(weakref.ref(h) for h in host), packed.spec, device, self._counter, written)
        self._counter += 1
        self._order.append(record)
        self._by_ptr[host[0].data_ptr()] = record
        return PackedTensor.rebuild(host, packed.spec)

    def reused(self, packed: PackedTensor) -> None:
        """Note one more op that will save (and fetch) the swapped ``packed`` (a deduplicated context)."""
        record = self._by_ptr.get(packed.payload.data_ptr())
        if record is not None:
            record.uses += 1

    # -- backward -----------------------------------------------------------------------------------------
    def is_swapped(self, packed: PackedTensor) -> bool:
        """Whether ``packed`` is the host copy of a swapped context (its address is unique while it lives)."""
        record = self._by_ptr.get(packed.payload.data_ptr())
        return record is not None and record.host[0]() is not None

    def fetch(self, packed: PackedTensor) -> PackedTensor:
        """The device copy of the swapped ``packed`` (ready for the current stream); prefetches the contexts
        swapped out before it."""
        record = self._by_ptr[packed.payload.data_ptr()]
        current = torch.cuda.current_stream(record.device)
        if record.fetched is None:
            current.wait_event(record.written)
            record.fetched = tuple(t.to(record.device, non_blocking=True) for t in packed.tensors)
        elif record.ready is not None:  # prefetched on the side stream
            current.wait_event(record.ready)
            for t in record.fetched:
                t.record_stream(current)
            record.ready = None
        out = PackedTensor.rebuild(record.fetched, record.spec)
        record.consumed += 1
        if record.consumed >= record.uses:
            record.fetched = None  # the ops using ``out`` hold it for as long as they need it
        self._prefetch_before(record)
        return out

    def _prefetch_before(self, record: _Swapped) -> None:
        if not self.prefetch:
            return
        side = self._stream(record.device)
        started = 0
        # records are in swap-out order; scan back from this one for the next ones backward will need
        i = bisect.bisect_left(self._order, record.order, key=lambda r: r.order) - 1
        while i >= 0 and started < self.prefetch:
            other = self._order[i]
            i -= 1
            if other.fetched is not None or other.consumed or other.device != record.device:
                continue
            host = tuple(r() for r in other.host)
            if any(h is None for h in host):
                continue
            with torch.cuda.stream(side):  # after other's device-to-host copy: the same stream
                other.fetched = tuple(h.to(other.device, non_blocking=True) for h in host)
                other.ready = side.record_event()
            started += 1

    # -- housekeeping -------------------------------------------------------------------------------------
    def purge(self) -> None:
        """Forget contexts whose host copies autograd has released (their graph was freed or run)."""
        live = [r for r in self._order if r.alive()]
        self._order = live
        self._by_ptr = {r.host[0]().data_ptr(): r for r in live}

    def __len__(self) -> int:
        self.purge()
        return len(self._order)
