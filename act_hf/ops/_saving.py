"""Saving a mix of tensors, packed contexts and ``None`` through ``ctx.save_for_backward``.

Everything an act_hf op keeps goes through ``save_for_backward`` (packed payloads are tensors too), so
saved-tensor hooks, ``torch.utils.checkpoint`` and :func:`act_hf.track_saved` see exactly what is kept.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.checkpoint import get_device_states, set_device_states

from ..compress import PackedTensor
from ..context import store
from ..derived import DERIVED_CONTEXTS, AffineTerm, RectifiedAffine, rebuild_derived

__all__ = ["OpSettings", "RngState", "autocast_cast", "autocast_casts", "autocast_dtype", "autocast_state",
           "load_context", "owned_output", "replayed_rng", "rng_state", "save_context"]


@dataclass(frozen=True)
class OpSettings:
    """What an op needs to compress one saved tensor: the slot name, its bits, the group size, whether the
    packed copy is swapped to host memory, whether the last dimension's channels are equalized first
    (``channel_scale``, see :func:`act_hf.compress.quantize`), the fewest bits of an input without autograd
    history (``data_bits``, ``ActConfig.data_bits``; 0: no floor; linears and convs apply it), the adaptive
    model's slot-bits table that the op's per-role slots read (``slot_bits``, see ``ContextStore.bits_for``;
    None: fixed bits), and whether a conv fed by a residual block's ``relu(bn(.) + shortcut)`` reads it from
    the tensors other ops saved (``share_residual``, ``ActConfig.share_residual``; :mod:`act_hf.derived`)."""

    slot: str
    bits: int
    group_size: int = 256
    swap: bool = False
    channel_scale: bool = False
    data_bits: int = 0
    slot_bits: Mapping[str, int] | None = field(default=None, compare=False)  # a dict: not hashed
    share_residual: bool = False


def owned_output(out: torch.Tensor) -> torch.Tensor:
    """``out``, or when it is a view of a tensor made inside an op's ``forward`` (``F.linear`` of a 3-d input,
    a permute, a squeeze), the same storage as a tensor of its own: autograd forbids in-place ops on a view a
    custom Function returns, while the unpatched op's output takes them (``ReLU(inplace=True)`` after a Linear).
    Only for views of the op's own intermediates, never of its inputs; call it before packing the output, since
    the context store knows a packed copy by the tensor object it was made from. ``detach`` makes it: a tensor that
    is no view (a tenth of the host time of ``aten._unsafe_view``, whose Python op call is the slow part)."""
    return out.detach() if out._is_view() else out


def autocast_state(device_type: str) -> dict[str, Any]:
    """The autocast settings in force for ``device_type``, as ``torch.autocast(device_type, **state)`` keyword
    arguments: what a backward that recomputes part of the forward records, to recompute under the same ones."""
    return {"enabled": torch.is_autocast_enabled(device_type), "dtype": torch.get_autocast_dtype(device_type),
            "cache_enabled": torch.is_autocast_cache_enabled()}


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes its lower-precision ops in on ``device_type``; ``None`` when it is off."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def autocast_casts(t: torch.Tensor | None, dtype: torch.dtype | None) -> bool:
    """Whether autocast's lower-precision policy (``F.linear``'s, SDPA's, on CPU and CUDA) casts ``t`` to ``dtype``
    (``None``: autocast off): a floating tensor of another dtype than ``dtype``, not float64."""
    return dtype is not None and t is not None and t.is_floating_point() and t.dtype not in (dtype, torch.float64)


def autocast_cast(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """``t`` as autocast's lower-precision policy hands it to an op computing in ``dtype`` (:func:`autocast_casts`)."""
    return t.to(dtype) if autocast_casts(t, dtype) else t


@dataclass(frozen=True)
class RngState:
    """The CPU generator's state and those of the accelerators some tensors live on (:func:`rng_state`)."""

    cpu: torch.Tensor
    device_type: str
    device_ids: list[int]
    device_states: list[torch.Tensor]


def rng_state(*tensors: torch.Tensor) -> RngState:
    """Capture the RNG states a recomputation of an op on ``tensors`` must restore to draw the same dropout
    masks: the CPU generator's, and the default generator's of each accelerator among the tensors' devices (as
    ``torch.utils.checkpoint`` does with ``preserve_rng_state=True``)."""
    device_type = next((t.device.type for t in tensors if t.device.type not in ("cpu", "meta")), "cpu")
    ids, states = get_device_states(*tensors) if device_type != "cpu" else ([], [])
    return RngState(torch.get_rng_state(), device_type, ids, states)


@contextmanager
def replayed_rng(state: RngState | None) -> Iterator[None]:
    """Run the block with the generators set to ``state``; on exit they are back where they were, so the
    recomputation consumes nothing of the caller's random stream. ``None`` runs the block as it is."""
    if state is None:
        yield
        return
    with torch.random.fork_rng(devices=state.device_ids, device_type=state.device_type):
        torch.set_rng_state(state.cpu)
        if state.device_ids:
            set_device_states(state.device_ids, state.device_states, device_type=state.device_type)
        yield


def save_context(ctx: Any, *items: torch.Tensor | PackedTensor | RectifiedAffine | AffineTerm | None) -> None:
    """Save ``items`` (tensors, :class:`PackedTensor`, the derived contexts of
    :data:`~act_hf.derived.DERIVED_CONTEXTS`, or ``None``) on ``ctx``; :func:`load_context` gives them back."""
    flat: list[torch.Tensor] = []
    layout: list[tuple] = []
    for item in items:
        if item is None:
            layout.append(("none",))
        elif isinstance(item, PackedTensor):
            layout.append(("packed", len(flat), item.spec))
            flat.extend(item.tensors)
        elif isinstance(item, DERIVED_CONTEXTS):
            tensors = item.tensors
            layout.append(("derived", len(flat), len(tensors), item.meta))
            flat.extend(tensors)
        elif isinstance(item, torch.Tensor):
            layout.append(("tensor", len(flat)))
            flat.append(item)
        else:
            raise TypeError(f"save_context takes tensors, PackedTensor, a derived context or None, "
                            f"got {type(item).__name__}")
    ctx.save_for_backward(*flat)
    ctx.act_layout = layout
    if store._probe is not None:  # ctx is the op's backward node
        store._probe.saved_by(ctx, tuple(leaf for i in items
                                         for leaf in (i.leaves() if isinstance(i, DERIVED_CONTEXTS)
                                                      else (i,))))


def load_context(ctx: Any) -> list[torch.Tensor | PackedTensor | RectifiedAffine | AffineTerm | None]:
    """The items given to :func:`save_context`, in order (a packed item is the probe's twin draw while a
    sensitivity probe redraws its group, see :meth:`act_hf.context.ContextStore.resolve`)."""
    saved = ctx.saved_tensors
    out: list[torch.Tensor | PackedTensor | None] = []
    for entry in ctx.act_layout:
        if entry[0] == "none":
            out.append(None)
        elif entry[0] == "packed":
            i, spec = entry[1], entry[2]
            out.append(store.resolve(PackedTensor.rebuild(saved[i : i + spec.n_tensors], spec)))
        elif entry[0] == "derived":
            i, n, meta = entry[1:]
            out.append(rebuild_derived(saved[i : i + n], meta, store.resolve))
        else:
            out.append(saved[entry[1]])
    return out
