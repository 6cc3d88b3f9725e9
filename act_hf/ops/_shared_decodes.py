"""One decode of a packed input for all the linears whose backward reads it.

The Q, K and V projections of an attention block (a gated MLP's gate and up projections too) read one hidden
state, which the context store packs once (:meth:`act_hf.context.ContextStore.compress`); each of their backwards
decoded it again for its weight gradient, three decodes in a row of the same payload. :data:`shared_decodes`
counts, in forward, the ops that will decode a packed tensor, and in backward hands them one decode: the first
reader decodes it, the last takes it away. A decode is a function of the payload alone, so a shared one is the
very bits each reader would have made. Its price is memory: the decode is alive from the first reader's backward
to the last one's (autograd runs them one after another), beside whatever those allocate.

A packed tensor with one reader is decoded as before, and nothing is kept. What a reader's backward never takes
(a graph differentiated in part) lives until its payload does; the entries hold the payload weakly.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..compress import PackedTensor

__all__ = ["SharedDecodes", "shared_decodes"]

Decoded = tuple[Tensor, Tensor | None]


@dataclass
class _Readers:
    payload: weakref.ref
    count: int = 0
    #: by dtype: the decode and how many readers took it
    decoded: dict[torch.dtype, list] = field(default_factory=dict)


class SharedDecodes:
    """Readers of packed tensors, counted in forward; their decodes, shared in backward."""

    def __init__(self) -> None:
        self._readers: dict[int, _Readers] = {}
        self._lock = threading.RLock()  # a payload freed inside a locked block calls _forget

    def expect(self, packed: object) -> None:
        """One more op's backward will decode ``packed`` through :meth:`decode` (a context other than a
        :class:`PackedTensor`, a derived one, is not counted)."""
        if not isinstance(packed, PackedTensor):
            return
        payload = packed.payload
        key = id(payload)
        with self._lock:
            readers = self._readers.get(key)
            if readers is None or readers.payload() is not payload:
                readers = _Readers(weakref.ref(payload, lambda _, key=key: self._forget(key)))
                self._readers[key] = readers
            readers.count += 1

    def decode(self, packed: object, dtype: torch.dtype, decode: Callable[[], Decoded]) -> Decoded:
        """``decode()`` of ``packed`` in ``dtype``, made once for all the readers :meth:`expect` counted: kept from
        the first reader's call and let go at the last one's. The caller must not write into what it gets."""
        if not isinstance(packed, PackedTensor):
            return decode()
        payload = packed.payload
        with self._lock:
            readers = self._readers.get(id(payload))
            if readers is None or readers.payload() is not payload or readers.count < 2:
                readers = None
            else:
                shared = readers.decoded.get(dtype)
        if readers is None:
            return decode()
        if shared is None:
            shared = [decode(), 0]
            with self._lock:
                shared = readers.decoded.setdefault(dtype, shared)
        with self._lock:
            shared[1] += 1
            if shared[1] >= readers.count:
                readers.decoded.pop(dtype, None)
        return shared[0]

    def _forget(self, key: int) -> None:
        with self._lock:
            readers = self._readers.get(key)
            if readers is not None and readers.payload() is None:
                del self._readers[key]

    def __len__(self) -> int:
        """Packed tensors with readers counted (alive)."""
        return len(self._readers)


#: the process's readers and decodes (act_hf's linears use it)
shared_decodes = SharedDecodes()
