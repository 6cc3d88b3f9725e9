"""Saving a mix of tensors, packed contexts and ``None`` through ``ctx.save_for_backward``.

Everything an act_hf op keeps goes through ``save_for_backward`` (packed payloads are tensors too), so
saved-tensor hooks, ``torch.utils.checkpoint`` and :func:`act_hf.track_saved` see exactly what is kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..compress import PackedTensor
from ..context import store
from ..derived import RectifiedAffine

__all__ = ["OpSettings", "autocast_state", "load_context", "save_context"]


@dataclass(frozen=True)
class OpSettings:
    """What an op needs to compress one saved tensor: the slot name, its bits, the group size, and whether
    the packed copy is swapped to host memory."""

    slot: str
    bits: int
    group_size: int = 256
    swap: bool = False


def autocast_state(device_type: str) -> dict[str, Any]:
    """The autocast settings in force for ``device_type``, as ``torch.autocast(device_type, **state)`` keyword
    arguments: what a backward that recomputes part of the forward records, to recompute under the same ones."""
    return {"enabled": torch.is_autocast_enabled(device_type), "dtype": torch.get_autocast_dtype(device_type),
            "cache_enabled": torch.is_autocast_cache_enabled()}


def save_context(ctx: Any, *items: torch.Tensor | PackedTensor | RectifiedAffine | None) -> None:
    """Save ``items`` (tensors, :class:`PackedTensor`, :class:`~act_hf.derived.RectifiedAffine` or ``None``) on
    ``ctx``; :func:`load_context` gives them back."""
    flat: list[torch.Tensor] = []
    layout: list[tuple] = []
    for item in items:
        if item is None:
            layout.append(("none",))
        elif isinstance(item, PackedTensor):
            layout.append(("packed", len(flat), item.spec))
            flat.extend(item.tensors)
        elif isinstance(item, RectifiedAffine):
            tensors = item.tensors
            layout.append(("rectified", len(flat), len(tensors), item.meta))
            flat.extend(tensors)
        elif isinstance(item, torch.Tensor):
            layout.append(("tensor", len(flat)))
            flat.append(item)
        else:
            raise TypeError(f"save_context takes tensors, PackedTensor, RectifiedAffine or None, "
                            f"got {type(item).__name__}")
    ctx.save_for_backward(*flat)
    ctx.act_layout = layout
    if store._probe is not None:  # ctx is the op's backward node
        store._probe.saved_by(ctx, tuple(i.packed if isinstance(i, RectifiedAffine) else i for i in items))


def load_context(ctx: Any) -> list[torch.Tensor | PackedTensor | RectifiedAffine | None]:
    """The items given to :func:`save_context`, in order (a packed item is the probe's twin draw while a
    sensitivity probe redraws its group, see :meth:`act_hf.context.ContextStore.resolve`)."""
    saved = ctx.saved_tensors
    out: list[torch.Tensor | PackedTensor | None] = []
    for entry in ctx.act_layout:
        if entry[0] == "none":
            out.append(None)
        elif entry[0] == "packed":
            i = entry[1]
            out.append(store.resolve(PackedTensor.rebuild(saved[i : i + 3], entry[2])))
        elif entry[0] == "rectified":
            i, n, meta = entry[1:]
            derived = RectifiedAffine.rebuild(saved[i : i + n], meta)
            derived.packed = store.resolve(derived.packed)
            out.append(derived)
        else:
            out.append(saved[entry[1]])
    return out
