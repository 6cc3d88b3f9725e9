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
    no longer carries the ``_user_hooks`` torch sets while the pass runs); True where torch does not say."""
    if region is None or not getattr(region, "_checkpoint_internal", False):
        return True
    return hasattr(region, "_user_hooks")
