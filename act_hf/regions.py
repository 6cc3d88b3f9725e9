"""Checkpoint regions: which pass of a ``torch.utils.checkpoint`` block the running code is in.

A non-reentrant checkpoint runs a block twice, its forward (whose saved tensors it drops) and, in backward, the
recomputation, and checks that both passes save tensors of the same number and shapes. act_hf's notes
(:mod:`act_hf.derived`) tie what an op may read instead of packing a tensor to that tensor's Python object. The
block's input is the same object in both passes only while no saved-tensor hooks are active: under any
(:func:`act_hf.track_saved`, ``torch.autograd.graph.save_on_cpu``) the recomputation gets a new object, so a note
made before the block was found in its forward and lost in its recomputation (timm ``resnet18`` with
``set_grad_checkpointing`` inside ``track_saved``: 54 tensors saved against 26, a ``CheckpointError``).

A *region* is the innermost checkpoint pass (or the code outside every checkpoint), named by the pack hook torch
pushes for it. Notes belong to the region that made them and are seen only there, so both passes decide alike
whatever hooks surround them; a block's first op packs its input itself, as it does outside checkpoints. The
saved-tensor hooks act_hf pushes itself (the fallback's scopes, the tracker) do not start a region: measuring a
forward does not change what it shares.

The innermost hooks are read with ``torch._C._autograd._top_saved_tensors_default_hooks`` (torch >= 2.11); where
torch lacks it every region is the outside one, as before regions existed.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

__all__ = ["TOP_HOOKS_QUERY", "current_region", "enter_own_hooks", "leave_own_hooks", "region_is_open"]

#: torch's query of the innermost saved-tensor hooks, ``(pack, unpack)`` or None (torch 2.11 has it, 2.6 does not)
TOP_HOOKS_QUERY = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)

_local = threading.local()


def _own_pushes() -> list[tuple[Any, Any]]:
    pushes = getattr(_local, "pushes", None)
    if pushes is None:
        pushes = _local.pushes = []
    return pushes


def current_region() -> Any:
    """The region the running code is in: the pack hook of the innermost saved-tensor hooks that are not act_hf's
    own, or ``None`` outside all of them (and wherever torch cannot say which hooks are innermost)."""
    if TOP_HOOKS_QUERY is None:
        return None
    top = TOP_HOOKS_QUERY(False)
    if top is None:
        return None
    pushes = _own_pushes()
    if pushes and top[0] is pushes[-1][0]:
        return pushes[-1][1]
    return top[0]


def enter_own_hooks(pack: Any) -> None:
    """Record that act_hf is about to push saved-tensor hooks whose pack hook is ``pack`` (the very object pushed):
    code inside them stays in the current region. Pair with :func:`leave_own_hooks` after popping them."""
    below = current_region()
    _own_pushes().append((pack, below))


def leave_own_hooks() -> None:
    """Forget the latest :func:`enter_own_hooks`."""
    _own_pushes().pop()


def region_is_open(region: Any) -> bool:
    """Whether code may still run in ``region``: False only for a checkpoint pass torch has left (its pack hook
    no longer carries the ``_user_hooks`` torch sets while the pass runs; torch 2.11, which marks neither, by the
    state of the checkpoint frame its pack hook closes over); True where torch does not say."""
    if region is None:
        return True
    if getattr(region, "_checkpoint_internal", False):
        return hasattr(region, "_user_hooks")
    return _unmarked_pass_is_open(region)


def _unmarked_pass_is_open(pack: Any) -> bool:
    """torch 2.11's checkpoint passes, told by the pack hook's own closure: the forward's is over once its frame
    has ``forward_completed``, the recomputation's once its frame ``is_recomputed`` for its graph task (or the
    frame is gone). Any other hook: True."""
    qualname = getattr(pack, "__qualname__", "")
    if qualname == "_checkpoint_hook.__init__.<locals>.pack_hook":
        frame = _closure_var(pack, "frame")
        return frame is None or not getattr(frame, "forward_completed", False)
    if qualname == "_recomputation_hook.__init__.<locals>.pack_hook":
        frame_ref, gid = _closure_var(pack, "target_frame_ref"), _closure_var(pack, "gid")
        frame = frame_ref() if callable(frame_ref) else None
        return frame is not None and not getattr(frame, "is_recomputed", {}).get(gid, False)
    return True


def _closure_var(fn: Any, name: str) -> Any:
    """The value of the free variable ``name`` of the closure ``fn``, or ``None``."""
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or cells is None or name not in code.co_freevars:
        return None
    try:
        return cells[code.co_freevars.index(name)].cell_contents
    except ValueError:  # an empty cell
        return None
