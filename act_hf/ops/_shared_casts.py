"""One autocast cast of a hidden state for the linears that read it one after another.

Under autocast a linear casts a float32 input to the autocast dtype, every call its own copy: the Q, K and V
projections of a BERT, ViT or LLaMA attention block read one norm's output (float32 under autocast) and cast it
three times, a gated MLP's gate and up projections twice, each cast a pass over the hidden state (six bytes an
element read and written). :data:`shared_casts` makes the cast once and hands it to the next reader: the same op on
the same bits, so each linear's output is the bits it was, and backward is untouched (each linear still takes the
float32 input; autograd casts each input gradient to float32 and sums them there, as unpatched).

Which readers share is learned: a call notes whether the call before it read the same tensor (the same object at
the same version, for the same dtype), and a reader keeps its cast for the next call only where, the last time it
ran, the next call read the same tensor (Q and K keep theirs, V does not). So a cast lives from the first reader to
the last (Q, K and V run one after another), never past a reader that was last; the first forward learns and
shares nothing. A kept cast is also let go when its source is freed or another tensor is cast, so one the next
reader never came for lives no longer than its source.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["SharedCasts", "shared_casts"]


@dataclass
class _Request:
    source: weakref.ref
    version: int
    dtype: torch.dtype
    reader: str
    cast: Tensor | None  # kept for the next reader, or None


class SharedCasts:
    """The last cast request, its cast when its reader keeps it, and which readers keep theirs."""

    def __init__(self) -> None:
        self._last: _Request | None = None
        self._keeps: dict[str, bool] = {}  # reader -> whether the call after its last one read the same tensor
        self._lock = threading.RLock()  # a source freed inside a locked block calls _release

    def cast(self, x: Tensor, dtype: torch.dtype, reader: str) -> Tensor:
        """``x.to(dtype)`` for the op named ``reader`` (a slot): the cast the previous call kept when it read the
        same ``x``, else a new one, kept for the next call if ``reader``'s next call read ``x`` too last time. The
        caller must not write into what it gets. A tensor that is not a plain eager one (a fake, traced or
        functorch-wrapped tensor) is cast anew and not noted."""
        if (type(x) is not Tensor or torch.compiler.is_compiling()
                or torch._C._functorch.is_functorch_wrapped_tensor(x)):
            return x.to(dtype)
        with self._lock:
            last = self._last
            same = (last is not None and last.source() is x and last.version == x._version
                    and last.dtype == dtype)
            if last is not None:
                self._keeps[last.reader] = same
            cast = last.cast if same else None
            self._last = None  # the previous cast goes with it unless handed on below
            keep = self._keeps.get(reader, False)
        if cast is None:
            cast = x.to(dtype)
        request = _Request(weakref.ref(x, self._release), x._version, dtype, reader, cast if keep else None)
        with self._lock:
            self._last = request
        return cast

    def _release(self, source: weakref.ref) -> None:
        with self._lock:
            if self._last is not None and self._last.source is source:
                self._last.cast = None

    def clear(self) -> None:
        """Let go of a kept cast and forget what was learned."""
        with self._lock:
            self._last = None
            self._keeps.clear()


#: the process's cast requests (act_hf's linears use it)
shared_casts = SharedCasts()
